from memtrain.cli import run

run()
