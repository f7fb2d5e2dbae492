"""Tooling, imported by nothing at run time: the ``cp-compile`` command line.

* :mod:`.cli` — the entry point and ``cp-compile plan`` (sizing a run on paper);
* :mod:`.graph_commands` — ``cp-compile dump`` / ``cp-compile explain``;
* :mod:`.explain` — traces a model without a process group and runs the same rewrite as the
  backend (:func:`cp_compile.backend.rewrite_for_cp`); :mod:`.explain_format` prints it;
* :mod:`.targets` — loads ``FILE.py:factory`` targets.
"""
