"""Triton kernels, each beside its torch reference and autograd.Function (see each module's docstring).

Note: the package attribute `selected_attention` is the FUNCTION; reach the module's other names with
`from efftx.kernels.selected_attention import ...` (plain `import efftx.kernels.selected_attention as m` would
resolve to the function).
"""

from efftx.kernels.selected_attention import selected_attention, selected_attention_reference, triton_available

__all__ = ["selected_attention", "selected_attention_reference", "triton_available"]
