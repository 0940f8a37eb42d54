"""``python -m fxdp`` runs the ``fxdp`` command line."""

from fxdp.cli import main

raise SystemExit(main())
