from memtrain.cli import main

main()
