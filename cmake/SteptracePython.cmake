# The Python package `steptrace` (bindings/python/steptrace, pure Python over ctypes),
# installed for the system python: STEPTRACE_INSTALL_PYTHONDIR/steptrace
# (lib/python3/dist-packages: with prefix /usr, the .deb, `import steptrace` works with
# Debian's python3). Included at the end of SteptraceInstall.cmake, which defines
# STEPTRACE_INSTALL_PYTHONDIR. Component "python", so a test can install it alone;
# `cmake --install` and cpack install every component.
#
# The package finds the library that the same install put in CMAKE_INSTALL_LIBDIR
# through steptrace/_install_paths.py, written at install time for the prefix installed
# to: the library directory relative to the package (a relocated prefix keeps working)
# and as an absolute path. Other copies of the package (pip, a source checkout) have no
# such file and use the system's search (steptrace/_loader.py).

install(DIRECTORY ${PROJECT_SOURCE_DIR}/bindings/python/steptrace
  DESTINATION ${STEPTRACE_INSTALL_PYTHONDIR}
  COMPONENT python
  FILES_MATCHING PATTERN "*.py"
  PATTERN "__pycache__" EXCLUDE
  PATTERN "_install_paths.py" EXCLUDE)

# Runs at install time, where CMAKE_INSTALL_PREFIX is the prefix installed to (without
# DESTDIR, which file(INSTALL) adds by itself), as in SteptraceInstallGenerated.cmake.in.
file(CONFIGURE OUTPUT ${PROJECT_BINARY_DIR}/SteptracePythonInstall.cmake @ONLY CONTENT [=[
set(_st_libdir "@CMAKE_INSTALL_LIBDIR@")
set(_st_pydir "@STEPTRACE_INSTALL_PYTHONDIR@")
foreach(_st_var _st_libdir _st_pydir)
  if(NOT IS_ABSOLUTE "${${_st_var}}")
    set(${_st_var} "${CMAKE_INSTALL_PREFIX}/${${_st_var}}")
  endif()
  cmake_path(NORMAL_PATH ${_st_var})
  string(REGEX REPLACE "(.)/$" "\\1" ${_st_var} "${${_st_var}}")
endforeach()
file(RELATIVE_PATH _st_rel "${_st_pydir}/steptrace" "${_st_libdir}")
# One scratch directory per destination, so installs to other prefixes at the same time
# (tests, cpack) do not write each other's file.
string(MD5 _st_dest "$ENV{DESTDIR}|${CMAKE_INSTALL_PREFIX}")
set(_st_out "@PROJECT_BINARY_DIR@/steptrace-install/python-${_st_dest}")
file(WRITE "${_st_out}/_install_paths.py"
  "# Written when this package was installed (cmake/SteptracePython.cmake): where the\n"
  "# same install put libsteptrace. steptrace/_loader.py looks there.\n"
  "LIBDIR_FROM_PACKAGE = \"${_st_rel}\"\n"
  "LIBDIR = \"${_st_libdir}\"\n")
file(INSTALL DESTINATION "${_st_pydir}/steptrace" TYPE FILE
  FILES "${_st_out}/_install_paths.py")
]=])
install(SCRIPT ${PROJECT_BINARY_DIR}/SteptracePythonInstall.cmake COMPONENT python)
