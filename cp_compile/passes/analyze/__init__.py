"""cp_compile.passes.analyze"""
