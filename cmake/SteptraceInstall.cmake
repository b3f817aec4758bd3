# Installation and packaging: what `cmake --install` and `cpack -G DEB` put where.
# Included only with STEPTRACE_INSTALL (default ON when steptrace is the top-level project,
# OFF under add_subdirectory), which also guards the install() rules of daemon/ and cli/.
#
#   client library  libsteptrace.so / .a, headers under include/steptrace/ (the public
#                   ones and the generated version.h), the CMake package `steptrace`
#                   (target steptrace::client) and steptrace.pc
#   daemon, CLI     installed by daemon/ and cli/ themselves
#   system files    systemd units, sysusers.d and tmpfiles.d entries, the default config
#   extras          the Python (ctypes) binding, Prometheus examples, a metrics drop-in
#   documentation   man pages, bash completion, copyright and changelog.gz
#                   (SteptraceDocs.cmake)
#
# Files that name absolute paths (the units' ExecStart, the config they pass, the .pc's
# prefix) are written at install time by SteptraceInstallGenerated.cmake.in, for the
# prefix actually installed to: `cmake --install build --prefix P` gives units that run
# P/bin/steptraced, and cpack (prefix /usr, DESTDIR staging) gives /usr/bin/steptraced
# and /etc/steptrace/steptraced.json, whatever prefix the build was configured with.
include(CMakePackageConfigHelpers)

# Relative to the install prefix unless given absolute.
set(STEPTRACE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/steptrace"
  CACHE STRING "Where the CMake package files go")
set(STEPTRACE_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig"
  CACHE STRING "Where steptrace.pc goes")
# Not `pkg-config --variable=systemdsystemunitdir systemd`: that is an absolute path
# (/lib/systemd/system on Debian 12) which ignores the install prefix, so a prefix or
# DESTDIR-less test install would write into the machine's /lib. lib/systemd/system under
# prefix /usr is on systemd's unit search path on every distribution (and on merged-/usr
# Debian 12 it is the very directory /lib/systemd/system points to).
set(STEPTRACE_INSTALL_SYSTEMDUNITDIR "lib/systemd/system"
  CACHE STRING "Where the systemd units go")
set(STEPTRACE_INSTALL_SYSUSERSDIR "lib/sysusers.d" CACHE STRING "Where sysusers.d entries go")
set(STEPTRACE_INSTALL_TMPFILESDIR "lib/tmpfiles.d" CACHE STRING "Where tmpfiles.d entries go")
# Debian's directory for version-independent Python modules: with prefix /usr (the .deb)
# `import steptrace` works with the system python3. Other prefixes: set PYTHONPATH.
set(STEPTRACE_INSTALL_PYTHONDIR "lib/python3/dist-packages"
  CACHE STRING "Where the Python package steptrace goes")
set(STEPTRACE_INSTALL_DATADIR "${CMAKE_INSTALL_DATADIR}/steptrace"
  CACHE STRING "Where examples (Prometheus configs, systemd drop-in) go")
option(STEPTRACE_INSTALL_SYSTEM_FILES
  "Install systemd units, sysusers.d/tmpfiles.d entries and the default config"
  ${STEPTRACE_BUILD_DAEMON})

# --- client library ---------------------------------------------------------------
# Consumers name the targets steptrace::client and steptrace::client_static.
set_target_properties(steptrace_client PROPERTIES EXPORT_NAME client)
set_target_properties(steptrace_client_static PROPERTIES EXPORT_NAME client_static)

install(TARGETS steptrace_client steptrace_client_static
  EXPORT steptraceTargets
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# Only the public headers: client/src and the daemon's headers are never installed.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/include/steptrace
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")
install(FILES ${STEPTRACE_GENERATED_INCLUDE_DIR}/steptrace/version.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/steptrace)

install(EXPORT steptraceTargets
  NAMESPACE steptrace::
  FILE steptraceTargets.cmake
  DESTINATION ${STEPTRACE_INSTALL_CMAKEDIR})
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/steptraceConfig.cmake.in
  ${PROJECT_BINARY_DIR}/steptraceConfig.cmake
  INSTALL_DESTINATION ${STEPTRACE_INSTALL_CMAKEDIR})
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/steptraceConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/steptraceConfig.cmake
  ${PROJECT_BINARY_DIR}/steptraceConfigVersion.cmake
  DESTINATION ${STEPTRACE_INSTALL_CMAKEDIR})

# --- Python binding (SteptracePython.cmake, included at the end) and examples -------
install(FILES
  ${PROJECT_SOURCE_DIR}/config/prometheus/prometheus.yml
  ${PROJECT_SOURCE_DIR}/config/prometheus/steptrace.rules.yml
  ${PROJECT_SOURCE_DIR}/config/prometheus/steptrace-nodes.json
  ${PROJECT_SOURCE_DIR}/config/prometheus/README.md
  DESTINATION ${STEPTRACE_INSTALL_DATADIR}/prometheus)
# The Grafana dashboard over those recording rules.
install(FILES
  ${PROJECT_SOURCE_DIR}/config/grafana/steptrace.json
  ${PROJECT_SOURCE_DIR}/config/grafana/README.md
  DESTINATION ${STEPTRACE_INSTALL_DATADIR}/grafana)

# --- system files -----------------------------------------------------------------
if(STEPTRACE_INSTALL_SYSTEM_FILES)
  install(FILES ${PROJECT_SOURCE_DIR}/systemd/steptraced.socket
    DESTINATION ${STEPTRACE_INSTALL_SYSTEMDUNITDIR})
  install(FILES ${PROJECT_SOURCE_DIR}/systemd/steptrace.sysusers
    DESTINATION ${STEPTRACE_INSTALL_SYSUSERSDIR} RENAME steptrace.conf)
  install(FILES ${PROJECT_SOURCE_DIR}/systemd/steptrace.tmpfiles
    DESTINATION ${STEPTRACE_INSTALL_TMPFILESDIR} RENAME steptrace.conf)
endif()

# The install-time part: steptraced.service, the metrics drop-in, the default config
# (to SYSCONFDIR as GNUInstallDirs resolves it for the install prefix: /etc for /usr)
# and steptrace.pc.
configure_file(${PROJECT_SOURCE_DIR}/cmake/SteptraceInstallGenerated.cmake.in
  ${PROJECT_BINARY_DIR}/SteptraceInstallGenerated.cmake @ONLY)
install(SCRIPT ${PROJECT_BINARY_DIR}/SteptraceInstallGenerated.cmake)

# --- Debian package: cpack -G DEB -> steptrace_<version>_amd64.deb -----------------
set(STEPTRACE_PACKAGE_MAINTAINER "steptrace maintainers <steptrace@example.org>"
  CACHE STRING "Maintainer field of the Debian package")

# Man pages, completion, /usr/share/doc/steptrace/{copyright,changelog.gz} (the last two
# name the maintainer above).
include(SteptraceDocs)

set(CPACK_PACKAGE_NAME steptrace)
set(CPACK_PACKAGE_VENDOR steptrace)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(CPACK_PACKAGE_DESCRIPTION
  "steptrace records where training processes spend their time (forward, backward,
matmul, attention, transfers, VRAM-ledger coordination) without running a tracer
inside them. Trainers link libsteptrace, which ships span events over a Unix socket
to steptraced, a systemd service that aggregates per process and per step, keeps a
live view of who holds VRAM on each GPU, and reports as text, JSON or Prometheus
metrics. This package holds the daemon, the steptrace CLI, the client library with
its headers, CMake and pkg-config files, and a Python binding.")
set(CPACK_PACKAGE_CONTACT "${STEPTRACE_PACKAGE_MAINTAINER}")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# Debian ships stripped binaries (debug symbols belong in a separate package).
set(CPACK_STRIP_FILES ON)

set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${STEPTRACE_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# Depends comes from dpkg-shlibdeps (dpkg-dev) over the ELF files in the package.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# A shlibs file, so packages built against libsteptrace.so.0 depend on this one.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "prometheus, python3")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)

# Maintainer scripts: create the user and state directory, enable and start the units
# when systemd runs (and only then: in a container they do no more than create the user).
set(_steptrace_deb_dir ${PROJECT_BINARY_DIR}/debian)
foreach(_script postinst prerm postrm)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/debian-${_script}.in
    ${_steptrace_deb_dir}/${_script} @ONLY
    FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE
    WORLD_READ WORLD_EXECUTE)
endforeach()
# The default config is a conffile: an administrator's edits survive upgrades. The path
# is where SteptraceInstallGenerated puts it for the package's prefix /usr.
file(WRITE ${_steptrace_deb_dir}/conffiles "/etc/steptrace/steptraced.json\n")
# libsteptrace.so.0 lands in a linker directory: refresh ld.so's cache, as dh_makeshlibs
# arranges for Debian's library packages.
file(WRITE ${_steptrace_deb_dir}/triggers "activate-noawait ldconfig\n")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
  ${_steptrace_deb_dir}/postinst
  ${_steptrace_deb_dir}/prerm
  ${_steptrace_deb_dir}/postrm
  ${_steptrace_deb_dir}/conffiles
  ${_steptrace_deb_dir}/triggers)

set(CPACK_GENERATOR DEB)
set(CPACK_SOURCE_GENERATOR TGZ)
set(CPACK_SOURCE_IGNORE_FILES "/\\\\.git/" "/build[^/]*/" "/out/" "__pycache__")
include(CPack)
include(SteptracePython)  # the Python package (cmake/SteptracePython.cmake)
