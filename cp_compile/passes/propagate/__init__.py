"""cp_compile.passes.propagate"""
