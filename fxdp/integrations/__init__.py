"""Optional integrations with other libraries; each module imports its library, so import it only when you use it.

``fxdp.integrations.transformers``  Hugging Face ``Trainer`` trained with DP-SGD (extra ``transformers``)
"""
