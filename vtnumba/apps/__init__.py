"""The programs built on the library: the command line, the demos, the tutorial helper, trace tools.

Nothing in the library layers (``backend`` ... ``models``) imports this package; programs
may import anything.  One module per program:

* :mod:`~vtnumba.apps.cli`           -- ``vtnumba`` / ``python -m vtnumba``: parses, picks the target,
  dispatches to the modules below (and to :mod:`vtnumba.bench`);
* :mod:`~vtnumba.apps.info`          -- ``vtnumba info``: versions, target and why, GPU, MPI;
* :mod:`~vtnumba.apps.pipeline_demo` -- ``vtnumba demo``: the main job (MiniLM with TPSP -> encoder
  cache -> semantic search);
* :mod:`~vtnumba.apps.embed`         -- ``vtnumba embed``: sentence embeddings, tensor-parallel;
* :mod:`~vtnumba.apps.runtime_tour`  -- ``vtnumba demo runtime``: queues, events, async copies
  (its kernel lives in :mod:`~vtnumba.apps.runtime_tour_kernels`);
* :mod:`~vtnumba.apps.trace_tools`   -- ``vtnumba trace``: merge per-rank traces, validate, draw;
* :mod:`~vtnumba.apps.tutorial`      -- what every tutorial script starts with.

Entry points are also where process-wide settings belong: :func:`vtnumba.apps.processes.share_cores_between_local_ranks`
shares the cores between local MPI ranks before numpy loads its BLAS; ``import vtnumba``
itself changes nothing in the process.
"""
