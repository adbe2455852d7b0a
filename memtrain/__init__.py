"""memtrain: memorization experiments on a 4D-parallel engine."""
