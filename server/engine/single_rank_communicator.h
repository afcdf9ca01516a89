// A Communicator for a group of one rank (DP=1 or TP=1 groups): every
// collective is a copy or a no-op, so single-rank groups cost no TCP device
// and no rendezvous.
//
//   std::unique_ptr<Communicator> comm = CreateSingleRankCommunicator();
//   CANZONA_RETURN_IF_ERROR(comm->AllReduce(data, n));   // no-op
//
// Thread-safety: as Communicator (one thread; Abort from any).
#ifndef CANZONA_SERVER_ENGINE_SINGLE_RANK_COMMUNICATOR_H_
#define CANZONA_SERVER_ENGINE_SINGLE_RANK_COMMUNICATOR_H_

#include <memory>

#include "server/comm/communicator.h"

namespace canzona {

std::unique_ptr<Communicator> CreateSingleRankCommunicator();

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_SINGLE_RANK_COMMUNICATOR_H_
