//! The key tables of `docs/configuration.md`, read in the page's pinned
//! format.
//!
//! The page has one `## `edge.toml`` and one `## `node.toml`` section; in
//! each, every table starts with the header line [`HEADER`] and its
//! separator, and every row has six cells: the key's full dotted path in
//! backticks, its type, its default, how a change applies, its range and
//! its meaning. A `|` inside a cell is written `\|`.

/// The header of every key table.
pub const HEADER: &str = "| Key | Type | Default | Reload | Range | Meaning |";

/// One documented key.
#[derive(Debug, Clone)]
pub struct Row {
    /// Its line in the page (1-based), for messages.
    pub line: usize,
    /// The dotted path (`nodes.adapters.capacity`).
    pub key: String,
    pub ty: String,
    pub default: DefaultCell,
    pub reload: Reload,
    pub range: Range,
}

/// The Default cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DefaultCell {
    /// `required`: a file without the key (its table present) is refused.
    Required,
    /// A cell that starts with a TOML value in backticks: leaving the key
    /// out is the same as writing that value.
    Value(String),
    /// Anything else: prose (no default, or one that depends on other
    /// keys), not checked.
    Prose,
}

/// The Reload cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    /// `live`: SIGHUP (and a cluster's published fleet) applies a change.
    Live,
    /// `restart`: only a restart applies a change.
    Restart,
    /// `—`: the key has no value of its own (a required table).
    None,
}

/// The Range cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Range {
    /// A cell that starts with `` `MIN` to `MAX` ``: exactly the integers
    /// accepted (with the other keys at their defaults).
    Integers(i64, i64),
    /// `—`: not a number.
    None,
    /// Anything else: prose (a range that depends on other keys).
    Prose,
}

/// The rows of the section `## `<file>``; panics, naming the line, on a row
/// that does not keep the format.
pub fn rows(page: &str, file: &str) -> Vec<Row> {
    let heading = format!("## `{file}`");
    let mut in_section = false;
    let mut in_table = false;
    let mut found = false;
    let mut out = Vec::new();
    let mut lines = page.lines().enumerate().peekable();
    while let Some((index, line)) = lines.next() {
        let number = index + 1;
        if line.starts_with("## ") {
            in_section = line.trim_end() == heading;
            found |= in_section;
            in_table = false;
            continue;
        }
        if !in_section {
            continue;
        }
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        if line.trim_end() == HEADER {
            match lines.next() {
                Some((_, separator)) if is_separator(separator) => {}
                _ => panic!("docs/configuration.md:{number}: a key table's header must be followed by its separator line"),
            }
            in_table = true;
            continue;
        }
        if !in_table {
            panic!(
                "docs/configuration.md:{number}: a table in the {file} section without the \
                 header {HEADER:?}"
            );
        }
        out.push(row(number, line));
    }
    assert!(found, "docs/configuration.md has no section {heading:?}");
    out
}

fn is_separator(line: &str) -> bool {
    let cells = cells(line);
    cells.len() == 6
        && cells
            .iter()
            .all(|c| !c.is_empty() && c.chars().all(|ch| ch == '-' || ch == ':'))
}

/// The cells of a table line, trimmed, `\|` unescaped.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim();
    let inner = inner.strip_prefix('|').unwrap_or(inner);
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let mut out = Vec::new();
    let mut cell = String::new();
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cell.push('|');
                chars.next();
            }
            '|' => out.push(std::mem::take(&mut cell).trim().to_owned()),
            c => cell.push(c),
        }
    }
    out.push(cell.trim().to_owned());
    out
}

fn row(line: usize, text: &str) -> Row {
    let cells = cells(text);
    let fail = |why: &str| -> ! { panic!("docs/configuration.md:{line}: {why}: {text}") };
    let [key, ty, default, reload, range, meaning] = cells.as_slice() else {
        fail("a key row has six cells");
    };
    let key = key
        .strip_prefix('`')
        .and_then(|k| k.strip_suffix('`'))
        .filter(|k| !k.is_empty() && !k.contains('`'))
        .unwrap_or_else(|| fail("the Key cell is the key's dotted path in backticks"));
    if meaning.is_empty() {
        fail("the Meaning cell is empty");
    }
    let default = match default.as_str() {
        "required" => DefaultCell::Required,
        cell => match leading_code(cell) {
            Some(value) => DefaultCell::Value(value.to_owned()),
            None => DefaultCell::Prose,
        },
    };
    let reload = match reload.as_str() {
        "live" => Reload::Live,
        "restart" => Reload::Restart,
        "—" => Reload::None,
        _ => fail("the Reload cell is `live`, `restart` or `—`"),
    };
    let range = match range.as_str() {
        "—" => Range::None,
        cell => integer_range(cell).map_or(Range::Prose, |(min, max)| Range::Integers(min, max)),
    };
    Row {
        line,
        key: key.to_owned(),
        ty: ty.clone(),
        default,
        reload,
        range,
    }
}

/// The text of the backticked span a cell starts with.
fn leading_code(cell: &str) -> Option<&str> {
    let rest = cell.strip_prefix('`')?;
    let end = rest.find('`')?;
    Some(&rest[..end])
}

/// `` `MIN` to `MAX` `` at the start of a cell (prose may follow).
fn integer_range(cell: &str) -> Option<(i64, i64)> {
    let min = leading_code(cell)?;
    let rest = cell[min.len() + 2..].strip_prefix(" to ")?;
    let max = leading_code(rest)?;
    Some((min.parse().ok()?, max.parse().ok()?))
}
