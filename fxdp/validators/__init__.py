"""Find the modules DP-SGD cannot train as they are, and fix them (the API of Opacus' validators).

``ModuleValidator.validate(model)`` lists the problems, ``ModuleValidator.fix(model)`` returns a fixed
copy. Default rules live one family per module; importing this package registers them:

- :mod:`~fxdp.validators.batch_norm`    — BatchNorm in training mixes samples; replaced by GroupNorm
  or LayerNorm, chosen by the layer's input shape
- :mod:`~fxdp.validators.instance_norm` — InstanceNorm running statistics; turned off
- :mod:`~fxdp.validators.inplace_flags` — ``inplace=True`` modules; always turned off by ``fix``
- :mod:`~fxdp.validators.dp_layers`     — stock LSTM/GRU/RNN/MultiheadAttention: valid; ``fix`` gives
  them the types of :mod:`fxdp.layers` (as Opacus's ``fix`` does), nothing else changes

Add rules for your own types with :func:`register_module_validator` / :func:`register_module_fixer`.

The compiler's validate pass applies the same rules to each layer the graph calls; it receives them from
the compiler rather than importing this package, which itself uses the front end and the inplace pass
(``fix(remove_inplace_ops=True)``): validators -> passes, one way.
"""

from fxdp.diagnostics import (
    IllegalModuleConfigurationError,
    ModuleFixWarning,
    NotYetSupportedModuleError,
    ShouldReplaceModuleError,
    UnsupportedError,
    UnsupportedModuleError,
)
from fxdp.validators.module_validator import (
    ModuleValidator,
    register_module_fixer,
    register_module_validator,
)
from fxdp.validators import batch_norm, dp_layers, instance_norm  # noqa: E402,F401  (the default rules)

__all__ = [
    "ModuleValidator",
    "register_module_validator",
    "register_module_fixer",
    "UnsupportedError",
    "UnsupportedModuleError",
    "ShouldReplaceModuleError",
    "IllegalModuleConfigurationError",
    "NotYetSupportedModuleError",
    "ModuleFixWarning",
]
