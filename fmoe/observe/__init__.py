"""What a layer or a run reports: routing statistics (`stats`), dashboards (`dashboards`), saved and
peak memory (`memory`, `cpu_memory`) and the kernels a layer launches (`launches`)."""
