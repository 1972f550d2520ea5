"""The `fmoe` command and what it runs: training the byte-level MoE GPT (`train`, with `runtime` and
`evaluation`; `gpt`, `data`), checkpoints and atomic writes (`checkpoints`, `files`) and conversion
between checkpoint layouts (`convert`, with `layouts` and `megatron_layout`). `cli` is the command line."""
