"""`fmoe bench`: GFLOP/s and memory of one MoE layer beside its competitors (see fmoe.bench.run)."""
