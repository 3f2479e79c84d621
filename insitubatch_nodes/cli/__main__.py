"""``python -m insitubatch_nodes.cli``: the ``insitubatch`` command without its script."""

from . import main

raise SystemExit(main())
