// Shared by the integration tests: a real steptraced on a temporary socket, its text
// commands, and a small JSON reader for `report --json` (the crate has no dependencies,
// so no serde).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::env;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// steptraced started on DIR/s.sock with DIR as its state directory; killed, and DIR
/// removed, on drop (its log printed first when the test failed).
pub struct Daemon {
    pub dir: PathBuf,
    pub socket: PathBuf,
    child: Child,
}

fn temp_dir() -> PathBuf {
    let base = env::temp_dir();
    for attempt in 0..100u32 {
        let nanos =
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let dir = base.join(format!("steptrace-rs-{}-{nanos}-{attempt}", std::process::id()));
        if fs::create_dir(&dir).is_ok() {
            return dir;
        }
    }
    panic!("cannot create a temporary directory in {}", base.display());
}

impl Daemon {
    pub fn start() -> Daemon {
        let bin = match env::var_os("STEPTRACE_DAEMON") {
            Some(bin) if !bin.is_empty() => PathBuf::from(bin),
            _ => panic!(
                "STEPTRACE_DAEMON is not set: it names the steptraced binary to test against \
                 (ctest -R rust sets it to the build tree's daemon/steptraced)"
            ),
        };
        let dir = temp_dir();
        let socket = dir.join("s.sock");
        let log = fs::File::create(dir.join("daemon.log")).expect("daemon.log");
        let mut command = Command::new(&bin);
        command
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(&dir)
            .args(["--nvml", "off", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; the daemon dies with this test's thread even
        // when the test process is killed (a ctest timeout).
        unsafe {
            command.pre_exec(|| {
                prctl(PR_SET_PDEATHSIG, SIGKILL as std::os::raw::c_ulong);
                Ok(())
            });
        }
        let child = command.spawn().unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        let mut daemon = Daemon { dir, socket, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(reply) = daemon.command("ping") {
                if reply.starts_with("pong") {
                    return daemon;
                }
            }
            if let Ok(Some(status)) = daemon.child.try_wait() {
                panic!("steptraced exited ({status}) before answering ping:\n{}", daemon.log());
            }
            if Instant::now() > deadline {
                panic!("steptraced did not answer ping within 20 s:\n{}", daemon.log());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// One text command, its whole reply (the daemon closes after answering).
    pub fn command(&self, line: &str) -> std::io::Result<String> {
        command(&self.socket, line)
    }

    /// `report --json --pid PID`: that process's object.
    pub fn process_report(&self, pid: u32) -> Json {
        let text = self.command(&format!("report --json --pid {pid}")).expect("report --json");
        let doc = Json::parse(&text).unwrap_or_else(|e| panic!("report --json: {e}: {text}"));
        let processes = doc.get("processes").as_array();
        let found = processes.iter().find(|p| p.get("pid").as_u64() == u64::from(pid));
        match found {
            Some(process) => process.clone(),
            None => panic!("pid {pid} not in the report: {text}"),
        }
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if thread::panicking() {
            eprintln!("--- steptraced's log ---\n{}", self.log());
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

pub fn command(socket: &Path, line: &str) -> std::io::Result<String> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(line.as_bytes())?;
    stream.write_all(b"\n")?;
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    Ok(reply)
}

/// {step name: completed spans} of a process object of `report --json`.
pub fn step_counts(process: &Json) -> BTreeMap<String, u64> {
    process
        .get("steps")
        .as_array()
        .iter()
        .map(|s| (s.get("step").as_str().to_string(), s.get("count").as_u64()))
        .collect()
}

/// The expected counts, for assert_eq! against step_counts.
pub fn counts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(name, n)| (name.to_string(), *n)).collect()
}

const PR_SET_PDEATHSIG: i32 = 1;
const SIGKILL: i32 = 9; // Linux, every architecture
extern "C" {
    fn prctl(option: i32, ...) -> i32;
}

// ---- a small JSON reader --------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Int(u64),
    Num(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

static NULL: Json = Json::Null;

impl Json {
    pub fn parse(text: &str) -> Result<Json, String> {
        let mut p = Parser { s: text.as_bytes(), i: 0 };
        let value = p.value()?;
        p.ws();
        if p.i != p.s.len() {
            return Err(format!("trailing bytes at {}", p.i));
        }
        Ok(value)
    }

    /// The member `key` of an object; Null when absent or not an object.
    pub fn get(&self, key: &str) -> &Json {
        match self {
            Json::Object(members) => {
                members.iter().find(|(k, _)| k == key).map(|(_, v)| v).unwrap_or(&NULL)
            }
            _ => &NULL,
        }
    }

    pub fn as_array(&self) -> &[Json] {
        match self {
            Json::Array(items) => items,
            other => panic!("not an array: {other:?}"),
        }
    }

    pub fn as_u64(&self) -> u64 {
        match self {
            Json::Int(n) => *n,
            other => panic!("not an unsigned integer: {other:?}"),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Json::Str(s) => s,
            other => panic!("not a string: {other:?}"),
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn expect(&mut self, word: &str) -> Result<(), String> {
        if self.s[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            Ok(())
        } else {
            Err(format!("expected {word} at {}", self.i))
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        self.ws();
        match self.peek() {
            Some(b'{') => self.object(),
            Some(b'[') => self.array(),
            Some(b'"') => self.string().map(Json::Str),
            Some(b't') => self.expect("true").map(|_| Json::Bool(true)),
            Some(b'f') => self.expect("false").map(|_| Json::Bool(false)),
            Some(b'n') => self.expect("null").map(|_| Json::Null),
            Some(_) => self.number(),
            None => Err("unexpected end".to_string()),
        }
    }

    fn object(&mut self) -> Result<Json, String> {
        self.i += 1;
        let mut members = Vec::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(Json::Object(members));
        }
        loop {
            self.ws();
            let key = self.string()?;
            self.ws();
            self.expect(":")?;
            let value = self.value()?;
            members.push((key, value));
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(Json::Object(members));
                }
                _ => return Err(format!("expected , or }} at {}", self.i)),
            }
        }
    }

    fn array(&mut self) -> Result<Json, String> {
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(Json::Array(items));
        }
        loop {
            items.push(self.value()?);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(Json::Array(items));
                }
                _ => return Err(format!("expected , or ] at {}", self.i)),
            }
        }
    }

    fn string(&mut self) -> Result<String, String> {
        self.expect("\"")?;
        let mut out = Vec::new();
        loop {
            let c = self.peek().ok_or("unterminated string")?;
            self.i += 1;
            match c {
                b'"' => return String::from_utf8(out).map_err(|e| e.to_string()),
                b'\\' => {
                    let e = self.peek().ok_or("unterminated escape")?;
                    self.i += 1;
                    match e {
                        b'"' | b'\\' | b'/' => out.push(e),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'u' => {
                            let hex = self.s.get(self.i..self.i + 4).ok_or("short \\u escape")?;
                            let hex = std::str::from_utf8(hex).map_err(|e| e.to_string())?;
                            let unit = u32::from_str_radix(hex, 16).map_err(|e| e.to_string())?;
                            self.i += 4;
                            // Surrogates (not in the reports this reads) become U+FFFD.
                            let ch = char::from_u32(unit).unwrap_or('\u{fffd}');
                            out.extend_from_slice(ch.to_string().as_bytes());
                        }
                        _ => return Err(format!("bad escape at {}", self.i)),
                    }
                }
                _ => out.push(c),
            }
        }
    }

    fn number(&mut self) -> Result<Json, String> {
        let start = self.i;
        while let Some(c) = self.peek() {
            if c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E') {
                self.i += 1;
            } else {
                break;
            }
        }
        let text = std::str::from_utf8(&self.s[start..self.i]).map_err(|e| e.to_string())?;
        if let Ok(n) = text.parse::<u64>() {
            return Ok(Json::Int(n));
        }
        text.parse::<f64>().map(Json::Num).map_err(|_| format!("bad value at {start}: {text:?}"))
    }
}
