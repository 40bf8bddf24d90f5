// A host-memory view of a device communicator: each collective copies its host input to
// device memory, runs the device collective, and copies the result back. EpMoe's control
// plane (routing decisions, counts, packing) works on host data; on GPUs it talks through
// this view. One synchronous round trip per collective: correct first, fast later.
#pragma once

#include <memory>

#include "epmoe/communicator.h"

namespace epmoe {

// `device` must outlive the view. For a CPU communicator there is nothing to stage:
// callers use it directly.
Result<std::unique_ptr<Communicator>> make_host_view(Communicator& device);

}  // namespace epmoe
