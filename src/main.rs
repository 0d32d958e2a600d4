//! The `cardworker` binary: parses the command line and hands it to the library.

use clap::Parser as _;

#[tokio::main]
async fn main() {
    let cli = cardworker::commands::Cli::parse();
    if let Err(e) = cardworker::commands::execute(cli).await {
        eprintln!("error: {e:#}");
        std::process::exit(e.exit_code());
    }
}
