//! `ckpt`: see [`ckpt_cli`].

fn main() {
    std::process::exit(ckpt_cli::main_with_args(std::env::args_os()));
}
