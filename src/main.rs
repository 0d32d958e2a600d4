//! The `cardworker` binary: parses the command line and hands it to the library.

use clap::Parser as _;

/// mimalloc, not the system's malloc: see its entry in Cargo.toml.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let cli = cardworker::commands::Cli::parse();
    // The console sits above the commands (it calls their actions), so it is dispatched here.
    let result = match cli.command {
        cardworker::commands::args::Command::Console(args) => {
            cardworker::console::execute(cli.config.as_deref(), args).await
        }
        command => {
            cardworker::commands::execute(cardworker::commands::Cli {
                command,
                config: cli.config,
            })
            .await
        }
    };
    if let Err(e) = result {
        // An error quotes what it was given (a config value, an argument): it is text, masked
        // for card numbers like every log line.
        eprintln!(
            "error: {}",
            cardworker::telemetry::pan::mask_pans_escaped(&format!("{e:#}"))
        );
        std::process::exit(e.exit_code());
    }
}
