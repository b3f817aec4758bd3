# The package's version: the project's (CMakeLists.txt `project(... VERSION)`); the
# client_python_package test checks that they agree. pyproject.toml reads it from here.
__version__ = "0.1.0"
