"""fxdp's errors (and the one warning), as users catch them: ``except fxdp.errors.NotPrivateError``.

They are defined, with the hierarchy explained, in :mod:`fxdp.diagnostics.errors`.
"""

from fxdp.diagnostics.errors import *  # noqa: F401,F403
from fxdp.diagnostics.errors import __all__  # noqa: F401
