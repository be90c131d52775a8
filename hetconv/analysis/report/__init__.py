"""``hetconv report``: what a run's ``metrics.jsonl`` says about its workload balance.

``records`` parses a run directory into typed records, ``analysis`` computes the
figures (a ``summary.RunSummary``) as pure functions, and ``render_text``,
``render_html`` (with ``plots``) and ``json_out`` show them; ``command`` is the
thin subcommand that ties them together.
"""
