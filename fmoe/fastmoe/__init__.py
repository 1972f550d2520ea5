"""FastMoE's module names over fmoe: `layers`, `linear`, `functions`, `utils`, `balance` and the
`fastermoe` package, importable at FastMoE's paths (`fmoe.layers`, ..., see `fmoe.old_paths`), and
`state`, which reads FastMoE's state-dict layout."""
