// steptrace::DEFAULT_SOCKET is the default socket path proto/commands.h defines for the
// daemon and the CLI (kDefaultSocketPath) and steptrace.h spells for C
// (STEPTRACE_DEFAULT_SOCKET). Rust cannot include either header, so this reads them.
// No daemon, no connection.

use std::path::Path;

// A file of the source tree, when the crate is built from one (not when vendored alone).
fn source_file(relative: &str) -> Option<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative);
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) => {
            eprintln!(
                "skipped: {} not readable ({e}): not in a steptrace source tree",
                path.display()
            );
            None
        }
    }
}

// The string literal that follows `marker` in `text`.
fn literal_after<'a>(text: &'a str, marker: &str) -> &'a str {
    let rest = text.split(marker).nth(1).unwrap_or_else(|| panic!("{marker} not found"));
    let start = rest.find('"').expect("an opening quote") + 1;
    let len = rest[start..].find('"').expect("a closing quote");
    &rest[start..start + len]
}

#[test]
fn default_socket_is_the_headers() {
    let (proto, c) = match (
        source_file("proto/commands.h"),
        source_file("client/include/steptrace/steptrace.h"),
    ) {
        (Some(proto), Some(c)) => (proto, c),
        _ => return,
    };
    assert_eq!(steptrace::DEFAULT_SOCKET, literal_after(&proto, "kDefaultSocketPath[] ="));
    assert_eq!(steptrace::DEFAULT_SOCKET, literal_after(&c, "#define STEPTRACE_DEFAULT_SOCKET"));
}
