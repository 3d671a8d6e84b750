/* Proves that include/keel/keel.h is C: this file is compiled as C99 with -pedantic and warnings
 * as errors, links against the library, and runs a few calls (a 1-rank group, a comm, options
 * and the error path) whose results it checks. Exits 0 on success. */
#include <stdio.h>
#include <string.h>

#include "keel/keel.h"

static int failures = 0;

static void expect(int condition, const char* what) {
  if (!condition) {
    fprintf(stderr, "c_api_compile_check: %s (last error: \"%s\")\n", what, keel_last_error());
    ++failures;
  }
}

int main(void) {
  keel_group_t* group = NULL;
  keel_comm_t* comm = NULL;
  keel_engine_options_t options;
  keel_engine_stats_t stats = {.struct_size = sizeof(keel_engine_stats_t)};
  int32_t slot_out[2];
  int64_t send_counts[1];
  int rank = -1;
  int size = -1;

  expect(keel_version() != NULL && keel_version()[0] != '\0', "keel_version is empty");
  expect(strcmp(keel_status_name(KEEL_INVALID_ARGUMENT), "INVALID_ARGUMENT") == 0,
         "keel_status_name(KEEL_INVALID_ARGUMENT)");

  expect(keel_group_create(1, &group) == KEEL_OK, "keel_group_create");
  expect(keel_comm_create_local(group, 0, &comm) == KEEL_OK, "keel_comm_create_local");
  expect(keel_comm_rank(comm, &rank) == KEEL_OK && rank == 0, "keel_comm_rank");
  expect(keel_comm_size(comm, &size) == KEEL_OK && size == 1, "keel_comm_size");
  expect(keel_last_error()[0] == '\0', "last error after success is not empty");

  expect(keel_engine_options_init(&options) == KEEL_OK, "keel_engine_options_init");
  expect(options.struct_size == sizeof(keel_engine_options_t), "options.struct_size");
  expect(options.gradient_type == KEEL_GRADIENT_FLOAT32 && options.memory == KEEL_MEMORY_HOST,
         "option defaults");

  expect(keel_engine_route(NULL, 0, NULL, 1, slot_out, send_counts, NULL, NULL) ==
             KEEL_INVALID_ARGUMENT,
         "keel_engine_route(NULL engine) is not KEEL_INVALID_ARGUMENT");
  expect(strstr(keel_last_error(), "engine = NULL") != NULL, "the message names the engine");
  expect(keel_engine_route_counts(NULL, 0, NULL, send_counts, NULL, NULL, NULL, NULL, NULL, 0, NULL,
                                  NULL) == KEEL_INVALID_ARGUMENT,
         "keel_engine_route_counts(NULL engine) is not KEEL_INVALID_ARGUMENT");
  expect(keel_engine_stats(NULL, &stats) == KEEL_INVALID_ARGUMENT, "keel_engine_stats(NULL)");

  expect(keel_group_destroy(group) == KEEL_FAILED_PRECONDITION, "group destroyed under its comm");
  expect(keel_comm_destroy(comm) == KEEL_OK, "keel_comm_destroy");
  expect(keel_group_destroy(group) == KEEL_OK, "keel_group_destroy");
  if (failures == 0) printf("c_api_compile_check: ok\n");
  return failures == 0 ? 0 : 1;
}
