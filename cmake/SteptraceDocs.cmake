# Documentation installed with the programs (included by SteptraceInstall.cmake):
#
#   man pages        docs/man/steptrace.1 and steptraced.8, gzipped (gzip -9n, as Debian
#                    wants them) into MANDIR/man1 and man8
#   bash completion  config/completion/steptrace.bash, as completions/steptrace and
#                    completions/steptraced (bash-completion loads a command's file by
#                    the command's name)
#   DOCDIR           copyright, in Debian's machine-readable format, made from LICENSE;
#                    changelog.gz, in Debian's changelog format, one entry for this version
#
# The man pages and the completion come with the daemon and CLI (STEPTRACE_BUILD_DAEMON).
find_program(STEPTRACE_GZIP gzip REQUIRED)

set(STEPTRACE_INSTALL_BASHCOMPLETIONDIR "${CMAKE_INSTALL_DATADIR}/bash-completion/completions"
  CACHE STRING "Where the bash completion of steptrace and steptraced goes")

set(_steptrace_docs_dir ${PROJECT_BINARY_DIR}/docs)

# --- copyright: LICENSE as Debian's copyright format 1.0 ------------------------------
# The license text after `License: Expat`, each line indented by one space and empty
# lines written as " ."; the holder from the LICENSE's "Copyright (c) ..." line.
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/LICENSE)
file(READ ${PROJECT_SOURCE_DIR}/LICENSE _steptrace_license)
if(NOT _steptrace_license MATCHES "Copyright \\(c\\) ([^\n]+)\n")
  message(FATAL_ERROR "LICENSE has no \"Copyright (c) ...\" line")
endif()
set(STEPTRACE_COPYRIGHT "${CMAKE_MATCH_1}")
string(FIND "${_steptrace_license}" "Permission is hereby granted" _steptrace_at)
if(_steptrace_at LESS 0)
  message(FATAL_ERROR "LICENSE is not the MIT (Expat) license text")
endif()
string(SUBSTRING "${_steptrace_license}" ${_steptrace_at} -1 _steptrace_license)
string(STRIP "${_steptrace_license}" _steptrace_license)
string(REPLACE "\n\n" "\n.\n" _steptrace_license "${_steptrace_license}")
string(REPLACE "\n" "\n " STEPTRACE_LICENSE_TEXT " ${_steptrace_license}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/debian-copyright.in
  ${_steptrace_docs_dir}/copyright @ONLY)

# --- changelog.gz: one entry for this version --------------------------------------------
# Dated the day it is configured (SOURCE_DATE_EPOCH, when set, fixes the day: reproducible
# builds).
string(TIMESTAMP STEPTRACE_CHANGELOG_DATE "%a, %d %b %Y 00:00:00 +0000" UTC)
configure_file(${PROJECT_SOURCE_DIR}/cmake/debian-changelog.in
  ${_steptrace_docs_dir}/changelog @ONLY)

# --- gzip -9n at build time ------------------------------------------------------------
set(_steptrace_gzipped)
function(_steptrace_gzip source output)
  add_custom_command(OUTPUT ${output}
    COMMAND ${CMAKE_COMMAND} -DGZIP=${STEPTRACE_GZIP} -DIN=${source} -DOUT=${output}
      -P ${PROJECT_SOURCE_DIR}/cmake/SteptraceGzip.cmake
    DEPENDS ${source} ${PROJECT_SOURCE_DIR}/cmake/SteptraceGzip.cmake
    COMMENT "gzip -9n ${source}"
    VERBATIM)
  set(_steptrace_gzipped ${_steptrace_gzipped} ${output} PARENT_SCOPE)
endfunction()

_steptrace_gzip(${_steptrace_docs_dir}/changelog ${_steptrace_docs_dir}/changelog.gz)
install(FILES ${_steptrace_docs_dir}/copyright ${_steptrace_docs_dir}/changelog.gz
  DESTINATION ${CMAKE_INSTALL_DOCDIR})

if(STEPTRACE_BUILD_DAEMON)
  _steptrace_gzip(${PROJECT_SOURCE_DIR}/docs/man/steptrace.1 ${_steptrace_docs_dir}/steptrace.1.gz)
  _steptrace_gzip(${PROJECT_SOURCE_DIR}/docs/man/steptraced.8
    ${_steptrace_docs_dir}/steptraced.8.gz)
  install(FILES ${_steptrace_docs_dir}/steptrace.1.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man1)
  install(FILES ${_steptrace_docs_dir}/steptraced.8.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man8)
  foreach(_steptrace_command steptrace steptraced)
    install(FILES ${PROJECT_SOURCE_DIR}/config/completion/steptrace.bash
      DESTINATION ${STEPTRACE_INSTALL_BASHCOMPLETIONDIR} RENAME ${_steptrace_command})
  endforeach()
endif()

add_custom_target(steptrace_docs ALL DEPENDS ${_steptrace_gzipped})
