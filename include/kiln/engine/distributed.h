// The MPI process group: one process per rank, started by `mpirun`, carrying the cross-process part of
// kiln's collectives (docs/mpi.md).
//
//   kiln::engine::SessionOptions options;
//   options.process_group = kiln::engine::mpi_world();   // rank(), size() from mpirun -np N
//   kiln::engine::InferenceSession session({kiln::DeviceRef::CPU()}, {}, options);
#pragma once

#include <memory>

#include "kiln/distributed.h"

namespace kiln::engine {

// Whether this build of kiln has MPI (it does when CMake found MPI and KILN_MPI is ON).
bool mpi_available();

// The group of every process of this MPI job (MPI_COMM_WORLD, duplicated so kiln's messages never
// match the application's own). The first call initialises MPI (MPI_Init_thread, asking for
// MPI_THREAD_MULTIPLE) unless the application already did; call it first from the main thread.
// MPI is finalised at process exit when kiln initialised it. Every call returns the same group.
// Its methods may be called from any thread, one call at a time (they lock); every rank must issue
// the same collectives in the same order. Run outside mpirun, it is a group of one.
// kiln::Error when kiln was built without MPI, when MPI was already finalised, or when the MPI
// library offers less than MPI_THREAD_SERIALIZED.
std::shared_ptr<ProcessGroup> mpi_world();

}  // namespace kiln::engine
