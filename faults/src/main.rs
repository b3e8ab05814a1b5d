//! `ckpt-faults`: fault campaigns against ckpt (`ckpt-faults --help`).

use std::process::ExitCode;

fn main() -> ExitCode {
    ckpt_faults::main(std::env::args())
}
