//! Shipped catalogs: tool catalogs for the agents people run, built into the binary
//! (`policy/catalogs/<name>.toml` in the repository), that a bundle includes by name
//! (`catalogs = ["claude-code"]` in `turnguard.toml`) or the serve setting `catalog`
//! selects (`--catalog claude-code,codex`). A bundle's own `catalogs/<name>.toml` is used
//! instead of the shipped file of that name, so a policy author can copy one and change a
//! classification. Each file is an ordinary `tools/*.toml` file (`ToolsFile`); the reasons
//! for each classification are in the files and in `policy/README.md`.

/// The shipped catalogs: name → TOML text.
pub const SHIPPED: &[(&str, &str)] = &[
    (
        "claude-code",
        include_str!("../../policy/catalogs/claude-code.toml"),
    ),
    ("codex", include_str!("../../policy/catalogs/codex.toml")),
    (
        "openai-agents",
        include_str!("../../policy/catalogs/openai-agents.toml"),
    ),
];

/// The word that selects no catalog (`--catalog none`).
pub const NONE: &str = "none";

/// The shipped catalog `name`, if there is one.
pub fn shipped(name: &str) -> Option<&'static str> {
    SHIPPED.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// The names of the shipped catalogs, comma-separated (for messages).
pub fn names() -> String {
    SHIPPED
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}
