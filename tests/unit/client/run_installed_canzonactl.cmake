# cmake -P script: install the build into a scratch prefix and run the
# installed canzonactl with no $CANZONA_MODELS_DIR: it must find the
# installed model configs (<prefix>/<MODELS_INSTALL_DIR>) by itself, and
# with no $CANZONA_PROFILES_DIR the installed hardware profiles
# (<prefix>/<PROFILES_INSTALL_DIR>) for `simulate`.
# -D BUILD_DIR, WORK_DIR, BINDIR (relative to the prefix), MODELS_INSTALL_DIR,
# PROFILES_INSTALL_DIR.
include(${CMAKE_CURRENT_LIST_DIR}/install_build.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
canzona_install_build(${BUILD_DIR} ${prefix})
set(ctl ${prefix}/${BINDIR}/canzonactl)
set(models ${prefix}/${MODELS_INSTALL_DIR})

function(run_plan model expect)
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env --unset=CANZONA_MODELS_DIR
            ${ctl} plan --model ${model} --dp 4 --tp 2 --json
    WORKING_DIRECTORY ${WORK_DIR}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "installed canzonactl plan --model ${model} exited ${rc}:\n${err}")
  endif()
  if(NOT out MATCHES "${expect}")
    message(FATAL_ERROR "plan --model ${model}: no ${expect} in\n${out}")
  endif()
  message("plan --model ${model}: ok")
endfunction()

if(NOT EXISTS ${models}/qwen3-8b.json)
  message(FATAL_ERROR "the install has no ${models}/qwen3-8b.json")
endif()
run_plan(qwen3-8b "\"digest\"")
# A config that exists only in the installed directory: planning it proves
# the lookup beside the executable, not the source tree's compiled-in path.
configure_file(${models}/qwen3-0.6b.json ${models}/installed-only-probe.json COPYONLY)
run_plan(installed-only-probe "\"model\": *\"installed-only-probe\"")

# Hardware profiles: the same lookup beside the executable.
set(profiles ${prefix}/${PROFILES_INSTALL_DIR})
if(NOT EXISTS ${profiles}/h100-node.json OR NOT EXISTS ${profiles}/h200-node.json)
  message(FATAL_ERROR "the install has no ${profiles}/h100-node.json and h200-node.json")
endif()
file(READ ${profiles}/h100-node.json probe)
string(REPLACE "\"name\": \"h100-node\"" "\"name\": \"installed-only-profile\""
       probe "${probe}")
file(WRITE ${profiles}/installed-only-profile.json "${probe}")
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env --unset=CANZONA_MODELS_DIR --unset=CANZONA_PROFILES_DIR
          ${ctl} simulate --model qwen3-0.6b --layers 1 --vocab 256 --dp 2 --tp 2
          --profile installed-only-profile --json
  WORKING_DIRECTORY ${WORK_DIR}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "installed canzonactl simulate exited ${rc}:\n${err}")
endif()
if(NOT out MATCHES "\"profile\": *\"installed-only-profile\"")
  message(FATAL_ERROR "simulate --profile installed-only-profile: not in\n${out}")
endif()
message("simulate --profile installed-only-profile: ok")
