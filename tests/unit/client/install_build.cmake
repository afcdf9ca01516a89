# canzona_install_build(<build dir> <prefix>): `cmake --install` of the build
# into a fresh scratch prefix, for the -P scripts that test the installed
# tree (run_consumer.cmake, run_installed_canzonactl.cmake).
function(canzona_install_build build_dir prefix)
  file(REMOVE_RECURSE ${prefix})
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${build_dir} --prefix ${prefix}
    RESULT_VARIABLE rc OUTPUT_QUIET)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install failed: ${rc}")
  endif()
endfunction()
