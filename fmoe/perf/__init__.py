"""FasterMoE's performance model (`perfmodel`), its constants measured on this machine (`calibration`)
and what it predicts over cluster sizes and loads (`simulate`, the `fmoe simulate` command). The
measured benchmarks are `fmoe.bench`."""
