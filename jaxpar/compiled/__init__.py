"""Reading compiled programs: the HLO's collectives and kernels (`hlo`), compiling for GPUs that
are not here (`targets`), and a compiled GPU program costed kernel by kernel (`ruler`)."""
