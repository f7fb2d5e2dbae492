"""cp_compile.passes.normalize"""
