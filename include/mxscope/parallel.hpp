// The processes of one run: the MPI ranks when mxscope was started by an MPI launcher (mpirun,
// srun) in a build with MPI (MXSCOPE_ENABLE_MPI), or this one process. Replay uses it to split its
// units of work across ranks (docs/scaling.md); everything else in mxscope runs in one process.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mxscope {

class process_group {
 public:
  virtual ~process_group() = default;
  virtual int rank() const { return 0; }
  virtual int size() const { return 1; }
  // This process's rank among the processes of its node (MPI_COMM_TYPE_SHARED): the GPU it uses.
  virtual int local_rank() const { return 0; }
  // Collective: every process passes a text, every process gets all of them, indexed by rank.
  virtual std::vector<std::string> all_gather(const std::string& text) { return {text}; }
  // With several processes: when the launcher terminates this process (SIGTERM, as mpirun and
  // srun do to every rank once one of them has died), `report` runs on another thread and the
  // process then exits with status 143. An empty function removes the report. A group of one
  // process keeps the default action of SIGTERM.
  virtual void on_termination(std::function<void()> report) { (void)report; }
};

// True when this binary was built with MPI.
bool mpi_available();

// The MPI world when this process was started by an MPI launcher (its environment names a rank:
// OMPI_COMM_WORLD_RANK, PMIX_RANK or PMI_RANK), initialized here and finalized when the returned
// object is destroyed; otherwise a group of one process. Throws input_error when a launcher
// started several processes but this build has no MPI (each would replay everything on its own).
std::unique_ptr<process_group> join_launched_processes();

}  // namespace mxscope
