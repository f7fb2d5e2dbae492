"""cp_compile.passes.finalize"""
