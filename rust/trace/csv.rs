//! RMM's logging CSV (`Thread,Time,Action,Pointer,Size,Stream`), plain or gzip-compressed.
//!
//! Actions are `allocate`, `free` and `allocate failure`; pointers and streams are hex
//! (`(nil)` is a null pointer); Time is seconds (`12.000250`) or a clock time (`HH:MM:SS.ffffff`,
//! or `HH:MM:SS:ffffff` as RMM's own replay benchmark reads it). Threads are not needed to
//! replay and are not read.

use super::{Action, Trace, TraceBuilder};
use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;

pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";
const COLUMNS: [&str; 6] = ["Thread", "Time", "Action", "Pointer", "Size", "Stream"];
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// The longest line read: a row is under 100 bytes, and a file with no newline for longer (a
/// compressed run of one byte, say) must not be read whole into memory to find out it is no CSV.
pub const LONGEST_LINE: usize = 64 << 10;

/// A trace that cannot be read, with where: the file and, once inside it, the line.
#[derive(Debug)]
pub struct CsvError {
    pub source: String,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for CsvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}, line {line}: {}", self.source, self.message),
            None => write!(f, "{}: {}", self.source, self.message),
        }
    }
}

impl std::error::Error for CsvError {}

/// Reads a trace file; gzip is recognised by its magic bytes, not by the file name.
pub fn read_path(path: &Path) -> Result<Trace, CsvError> {
    let source = path.display().to_string();
    let error = |message: String| CsvError { source: source.clone(), line: None, message };
    let mut file = BufReader::new(File::open(path).map_err(|e| error(e.to_string()))?);
    let gzip = file.fill_buf().map_err(|e| error(e.to_string()))?.starts_with(&GZIP_MAGIC);
    if gzip {
        read(BufReader::new(MultiGzDecoder::new(file)), &source)
    } else {
        read(file, &source)
    }
}

/// Column positions, from the header.
struct Layout {
    time: usize,
    action: usize,
    pointer: usize,
    size: usize,
    stream: usize,
    width: usize,
}

impl Layout {
    fn from_header(header: &str) -> Result<Layout, String> {
        let names: Vec<&str> = header.trim_start_matches('\u{feff}').split(',').map(str::trim).collect();
        let find = |column: &str| {
            names.iter().position(|n| *n == column).ok_or_else(|| format!("bad header '{header}': expected {HEADER}"))
        };
        for column in COLUMNS {
            find(column)?;
        }
        Ok(Layout {
            time: find("Time")?,
            action: find("Action")?,
            pointer: find("Pointer")?,
            size: find("Size")?,
            stream: find("Stream")?,
            width: names.len(),
        })
    }
}

/// Reads CSV text; `source` names it in errors.
pub fn read(mut input: impl BufRead, source: &str) -> Result<Trace, CsvError> {
    let error = |line: usize, message: String| CsvError { source: source.to_string(), line: Some(line), message };
    let mut text = String::new();
    let mut line = 0;
    let mut next_line = |text: &mut String| -> Result<bool, CsvError> {
        text.clear();
        line += 1;
        match (&mut input).take(LONGEST_LINE as u64 + 1).read_line(text) {
            Ok(n) if n > LONGEST_LINE => Err(error(line, format!("the line is longer than {LONGEST_LINE} bytes"))),
            Ok(n) => Ok(n > 0),
            Err(e) => Err(error(line, format!("cannot read this line ({e}): is the file truncated, or not text?"))),
        }
    };
    if !next_line(&mut text)? {
        return Err(error(1, format!("empty file: expected the header {HEADER}")));
    }
    let layout = Layout::from_header(text.trim_end()).map_err(|m| error(1, m))?;
    let mut builder = TraceBuilder::default();
    let mut first_time = None;
    let mut number = 1;
    while next_line(&mut text)? {
        number += 1;
        let row = text.trim_end();
        if row.is_empty() {
            continue;
        }
        let fields: Vec<&str> = row.split(',').collect();
        if fields.len() != layout.width {
            return Err(error(number, format!("expected {} fields, found {}", layout.width, fields.len())));
        }
        let at = |message: String| error(number, message);
        let time = parse_time(fields[layout.time]).map_err(at)?;
        let time_ns = time.saturating_sub(*first_time.get_or_insert(time));
        let pointer = parse_hex(fields[layout.pointer], "pointer").map_err(at)?;
        let size =
            fields[layout.size].trim().parse::<u64>().map_err(|_| at(format!("bad size '{}'", fields[layout.size])))?;
        let stream = parse_hex(fields[layout.stream], "stream").map_err(at)?;
        let outcome = match fields[layout.action].trim() {
            "allocate" => builder.alloc(pointer, size, stream, time_ns),
            "free" => builder.free(pointer, stream, time_ns),
            "allocate failure" => {
                builder.failure(size, stream, time_ns);
                Ok(())
            }
            other => return Err(at(format!("unknown action '{other}' (expected allocate, free or allocate failure)"))),
        };
        outcome.map_err(|e| at(e.to_string()))?;
    }
    Ok(builder.finish())
}

/// `0x7f00`, `7f00` or `(nil)`; streams may also be written in decimal by other tools, but a
/// bare number is read as hex, as RMM writes it.
fn parse_hex(field: &str, what: &str) -> Result<u64, String> {
    let t = field.trim();
    if t == "(nil)" {
        return Ok(0);
    }
    let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    u64::from_str_radix(digits, 16).map_err(|_| format!("bad {what} '{field}' (expected hex such as 0x7f3a00)"))
}

/// Nanoseconds from `S.fraction` or `H:M:S.fraction` or `H:M:S:micros`; a time past 2**64 ns
/// (585 years) is refused rather than wrapped.
fn parse_time(field: &str) -> Result<u64, String> {
    let bad = || format!("bad time '{field}' (expected seconds such as 1.25 or a clock time HH:MM:SS.ffffff)");
    let parts: Vec<&str> = field.trim().split(':').collect();
    let (clock, seconds) = match parts.as_slice() {
        [s] => (0, *s),
        [h, m, s] => (hours_minutes(h, m).ok_or_else(bad)?, *s),
        [h, m, s, micros] if micros.len() == 6 => {
            let whole = s.parse::<u64>().ok().and_then(|s| s.checked_mul(1_000_000_000));
            let micros = micros.parse::<u64>().map_err(|_| bad())? * 1000;
            let clock = hours_minutes(h, m).ok_or_else(bad)?;
            return whole.and_then(|ns| ns.checked_add(micros)?.checked_add(clock)).ok_or_else(bad);
        }
        _ => return Err(bad()),
    };
    let (whole, fraction) = seconds.split_once('.').unwrap_or((seconds, ""));
    if fraction.len() > 9 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let whole = whole.parse::<u64>().map_err(|_| bad())?;
    let fraction_ns = format!("{fraction:0<9}").parse::<u64>().map_err(|_| bad())?;
    whole.checked_mul(1_000_000_000).and_then(|ns| ns.checked_add(fraction_ns)?.checked_add(clock)).ok_or_else(bad)
}

fn hours_minutes(h: &str, m: &str) -> Option<u64> {
    let (h, m) = (h.parse::<u64>().ok()?, m.parse::<u64>().ok()?);
    h.checked_mul(3600)?.checked_add(m.checked_mul(60)?)?.checked_mul(1_000_000_000)
}

/// Writes `trace` as RMM CSV: Time in seconds since the first event, thread 0. RMM's log has
/// no word for the job's releases of cached memory: they are left out, and their number is
/// returned so that the caller can say so.
pub fn write(trace: &Trace, out: impl Write) -> io::Result<usize> {
    let mut out = BufWriter::new(out);
    writeln!(out, "{HEADER}")?;
    let mut left_out = 0;
    for e in trace.events() {
        let (seconds, nanos) = (e.time_ns / 1_000_000_000, e.time_ns % 1_000_000_000);
        let stream = trace.streams()[e.stream as usize];
        let action = match e.action {
            Action::Alloc => "allocate",
            Action::Free => "free",
            Action::Failure => "allocate failure",
            Action::EmptyCache | Action::OomRelease => {
                left_out += 1;
                continue;
            }
        };
        let pointer = if e.action == Action::Failure { "(nil)".to_string() } else { format!("{:#x}", e.address) };
        writeln!(out, "0,{seconds}.{nanos:09},{action},{pointer},{},{stream:#x}", e.size)?;
    }
    out.flush()?;
    Ok(left_out)
}

/// Writes `trace` to `path`, gzip-compressed when the name ends in `.gz`; returns how many
/// events RMM's format could not say (see [`write`]).
pub fn write_path(trace: &Trace, path: &Path) -> io::Result<usize> {
    let file = File::create(path)?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut gz = GzEncoder::new(file, flate2::Compression::default());
        let left_out = write(trace, &mut gz)?;
        gz.finish()?.sync_all()?;
        Ok(left_out)
    } else {
        write(trace, file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::GzEncoder;
    use std::path::PathBuf;

    const SAMPLE: &str = "Thread,Time,Action,Pointer,Size,Stream
140573312345856,0.000000,allocate,0x7f8a40000000,1024,0x0
140573312345857,0.000250,allocate,0x7f8a40000400,2048,0x7f8a38001020
140573312345856,0.001000,free,0x7f8a40000000,1024,0x0
140573312345856,0.002000,allocate failure,(nil),1099511627776,0x0
140573312345857,0.003000,free,0x7f8a40000400,2048,0x7f8a38001020
";

    fn read_str(text: &str) -> Result<Trace, CsvError> {
        read(text.as_bytes(), "sample.csv")
    }

    #[test]
    fn reads_streams_failures_and_pairs_frees() {
        let trace = read_str(SAMPLE).unwrap();
        let actions: Vec<Action> = trace.events().iter().map(|e| e.action).collect();
        assert_eq!(actions, [Action::Alloc, Action::Alloc, Action::Free, Action::Failure, Action::Free]);
        assert_eq!(trace.streams(), [0, 0x7f8a38001020]);
        assert_eq!(trace.events()[4].slot, 1);
        assert_eq!(trace.events()[4].stream, 1);
        assert_eq!(trace.events()[1].time_ns, 250_000);
        assert_eq!(trace.peak_live_bytes(), 3072);
        assert_eq!(trace.allocations(), 2);
    }

    #[test]
    fn clock_times_and_reordered_columns() {
        let text = "Action,Pointer,Size,Stream,Thread,Time\nallocate,0x1000,512,0x0,1,10:00:01.500000\nfree,0x1000,512,0x0,1,10:00:02:000250\n";
        let trace = read_str(text).unwrap();
        assert_eq!(trace.events()[1].time_ns, 500_250_000);
    }

    #[test]
    fn writing_then_reading_gives_the_same_trace() {
        let trace = read_str(SAMPLE).unwrap();
        let mut out = Vec::new();
        write(&trace, &mut out).unwrap();
        let again = read(out.as_slice(), "written.csv").unwrap();
        assert_eq!(again, trace);
    }

    fn error_of(text: &str) -> String {
        read_str(text).unwrap_err().to_string()
    }

    #[test]
    fn malformed_input_names_the_file_and_line() {
        assert_eq!(
            error_of("Thread,Time,Action,Pointer\n"),
            format!("sample.csv, line 1: bad header 'Thread,Time,Action,Pointer': expected {HEADER}")
        );
        assert!(error_of("").contains("empty file"));
        let body = |row: &str| format!("{HEADER}\n0,0.0,allocate,0x1000,512,0x0\n{row}\n");
        assert!(
            error_of(&body("0,0.1,realloc,0x1000,512,0x0")).starts_with("sample.csv, line 3: unknown action 'realloc'")
        );
        assert!(error_of(&body("0,0.1,free,0x2000,512,0x0")).starts_with("sample.csv, line 3: free of 0x2000"));
        assert!(error_of(&body("0,0.1,allocate,0x1000,512,0x0"))
            .contains("line 3: allocation at 0x1000, which is still allocated"));
        assert!(error_of(&body("0,0.1,allocate,0x2000,big,0x0")).contains("line 3: bad size 'big'"));
        assert!(error_of(&body("0,0.1,allocate,zz,5,0x0")).contains("line 3: bad pointer 'zz'"));
        assert!(error_of(&body("0,yesterday,allocate,0x2000,5,0x0")).contains("line 3: bad time 'yesterday'"));
        assert!(error_of(&body("0,0.1,allocate,0x2000,5")).contains("line 3: expected 6 fields, found 5"));
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpupool-csv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn gzip_files_round_trip_and_truncation_is_an_error() {
        let trace = read_str(SAMPLE).unwrap();
        let path = scratch("sample.csv.gz");
        write_path(&trace, &path).unwrap();
        assert_eq!(read_path(&path).unwrap(), trace);
        let bytes = std::fs::read(&path).unwrap();
        let cut = scratch("cut.csv.gz");
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let message = read_path(&cut).unwrap_err().to_string();
        assert!(message.starts_with(&format!("{}, line ", cut.display())), "{message}");
        assert!(message.contains("truncated"), "{message}");
        let missing = read_path(&scratch("missing.csv")).unwrap_err().to_string();
        assert!(missing.contains("missing.csv"), "{missing}");
    }

    #[test]
    fn plain_gzip_stream_of_many_lines_reads() {
        let mut text = String::from(HEADER);
        for i in 0..1000u64 {
            text.push_str(&format!("\n0,{i}.5,allocate,{:#x},{},0x0", 0x10000 + i * 0x1000, 512 + i));
        }
        let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(text.as_bytes()).unwrap();
        let path = scratch("many.csv.gz");
        std::fs::write(&path, gz.finish().unwrap()).unwrap();
        assert_eq!(read_path(&path).unwrap().events().len(), 1000);
    }

    /// The real traces shipped beside the repository (skipped when absent).
    #[test]
    fn shared_traces_read_and_every_allocation_is_freed() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            eprintln!("skipped: no {}", dir.display());
            return;
        };
        for path in entries.map(|e| e.unwrap().path()).filter(|p| p.to_string_lossy().ends_with(".csv.gz")) {
            let trace = read_path(&path).unwrap();
            let allocs = trace.events().iter().filter(|e| e.action == Action::Alloc).count();
            assert_eq!(allocs * 2, trace.events().len(), "{}", path.display());
            assert!(trace.peak_live_bytes() > 100 << 20);
            assert_eq!(trace.streams(), [0]);
        }
    }
}
