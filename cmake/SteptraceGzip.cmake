# cmake -DGZIP=gzip -DIN=file -DOUT=file.gz -P SteptraceGzip.cmake: OUT = `gzip -9n` of IN
# (best compression, no name or time stamp in the header: the same input gives the same
# bytes, as Debian wants for man pages and changelogs). Used by SteptraceDocs.cmake.
execute_process(COMMAND ${GZIP} -9 -n -c ${IN}
  OUTPUT_FILE ${OUT}.tmp
  RESULT_VARIABLE _result)
if(NOT _result EQUAL 0)
  file(REMOVE ${OUT}.tmp)
  message(FATAL_ERROR "${GZIP} -9 -n -c ${IN} failed: ${_result}")
endif()
file(RENAME ${OUT}.tmp ${OUT})
