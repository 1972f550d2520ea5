"""fmoe in other frameworks: DeepSpeed (`deepspeed`), Megatron-Core (`megatron`) and HF transformers
(`hf`). Each imports its framework when imported, never before."""
