// transitional: server/engine moves to proto/shm/shared_memory.h.
//
// Forwards to the trainer <-> daemon shared-memory protocol's new home, so
// that server/engine builds until it includes proto/shm/shared_memory.h
// itself; delete this file then. Nothing else may include it (server/ must
// not include client/).
#ifndef CANZONA_CLIENT_SHM_SHARED_MEMORY_H_
#define CANZONA_CLIENT_SHM_SHARED_MEMORY_H_

#include "proto/shm/shared_memory.h"  // IWYU pragma: export

#endif  // CANZONA_CLIENT_SHM_SHARED_MEMORY_H_
