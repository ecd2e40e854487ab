//! The `smoe-pipeline` binary (the application is the library, [`smoe_pipeline`]).

fn main() -> std::process::ExitCode {
    smoe_pipeline::main()
}
