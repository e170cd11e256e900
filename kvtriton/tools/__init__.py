"""Operator tools: the ``kvtriton`` command line and what it runs.

``cli`` is the entry point; ``demo``, ``simulate`` (with its ``workloads`` and
``replay``), ``bench_command`` and ``info`` are its subcommands, ``geometry``
converts model shapes into bytes per block and ``progress`` draws progress on
long runs. The worker and the manager never import from here.
"""
