//! Starting the ranks of an MPI test.

/// A `mpirun -np N` command with the settings every ckpt job here uses:
/// `--oversubscribe` (more ranks than cores), the shared-memory transport without
/// cross-process memory attach (which containers often forbid), and permission to
/// run as root. Add `-x VAR`, the program and its arguments.
pub fn mpirun(np: usize) -> std::process::Command {
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args(["--oversubscribe", "-np", &np.to_string()])
        .args([
            "--mca",
            "btl",
            "self,vader",
            "--mca",
            "btl_vader_single_copy_mechanism",
            "none",
        ])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1");
    cmd
}
