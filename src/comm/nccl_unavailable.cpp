// Builds without NCCL (no nccl.h / libnccl found at configure time): the backend reports
// that it is absent instead of failing to link.
#include "epmoe/communicator.h"

namespace epmoe {

bool nccl_available() { return false; }

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const NcclOptions&) {
  return Status::unsupported("this build of epmoe has no NCCL backend (configure with NCCL installed)");
}

}  // namespace epmoe
