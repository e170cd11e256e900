"""Development tools for the kernels in ``kernels/``, kept out of the wheel (``pyproject.toml`` ships ``kvtriton.*`` only).

``codegen`` compiles the production kernels for sm_90 on any machine and reads
their access and multiply widths (the code-generation gate in
``tests/kernels/test_kernels_codegen.py``, ``bench/kernels.py --ptx``);
``compile_asm`` is the compile it runs in a child process; ``compiled_variants``
reports the registers and spills of the variants Triton compiled in this
process (``bench/gpu_check.sh``). Nothing in ``kvtriton`` imports them.
"""
