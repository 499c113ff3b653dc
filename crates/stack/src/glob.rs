//! Shell-style globs over paths, and sizes written for people (`64k`, `1G`): shared by rules
//! files, the fault layer and anything else that picks files by path.

/// A shell-style glob: `*` (any run of characters except '/'), `**` (anything, '/' included),
/// `?` (one character except '/'), `[abc]`, `[a-z]`, `[!abc]`, and `\` to quote.
#[derive(Debug, Clone)]
pub struct Glob {
    pub pattern: String,
    tokens: Vec<Token>,
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Char(char),
    Any,
    Star,
    DoubleStar,
    Class { negated: bool, ranges: Vec<(char, char)> },
}

impl Glob {
    pub fn new(pattern: &str) -> std::result::Result<Glob, String> {
        let pattern = pattern.trim_start_matches('/');
        let mut tokens = Vec::new();
        let mut chars = pattern.chars().peekable();
        while let Some(c) = chars.next() {
            let t = match c {
                '\\' => Token::Char(chars.next().ok_or_else(|| format!("glob {pattern:?} ends with '\\'"))?),
                '?' => Token::Any,
                '*' if chars.peek() == Some(&'*') => {
                    chars.next();
                    // `**/` also matches no directory at all: `a/**/b` matches `a/b`.
                    if chars.peek() == Some(&'/') {
                        chars.next();
                        tokens.push(Token::DoubleStar);
                        tokens.push(Token::Char('/'));
                        continue;
                    }
                    Token::DoubleStar
                }
                '*' => Token::Star,
                '[' => {
                    let negated = chars.peek().is_some_and(|c| *c == '!' || *c == '^');
                    if negated {
                        chars.next();
                    }
                    let mut ranges = Vec::new();
                    let mut first = true;
                    loop {
                        let c = chars.next().ok_or_else(|| format!("glob {pattern:?}: '[' without ']'"))?;
                        if c == ']' && !first {
                            break;
                        }
                        first = false;
                        if chars.peek() == Some(&'-') {
                            let mut ahead = chars.clone();
                            ahead.next();
                            if let Some(&end) = ahead.peek().filter(|e| **e != ']') {
                                chars.next();
                                chars.next();
                                ranges.push((c, end));
                                continue;
                            }
                        }
                        ranges.push((c, c));
                    }
                    Token::Class { negated, ranges }
                }
                c => Token::Char(c),
            };
            tokens.push(t);
        }
        if pattern.is_empty() {
            return Err("empty glob".into());
        }
        Ok(Glob { pattern: pattern.to_owned(), tokens })
    }

    pub fn matches(&self, subject: &str) -> bool {
        let s: Vec<char> = subject.chars().collect();
        self.matches_chars(&s)
    }

    /// As [`Glob::matches`], for a subject already split into characters.
    pub fn matches_chars(&self, subject: &[char]) -> bool {
        matches_from(&self.tokens, subject)
    }
}

fn matches_from(tokens: &[Token], s: &[char]) -> bool {
    let Some((first, rest)) = tokens.split_first() else {
        return s.is_empty();
    };
    match first {
        Token::Char(c) => s.first() == Some(c) && matches_from(rest, &s[1..]),
        Token::Any => s.first().is_some_and(|c| *c != '/') && matches_from(rest, &s[1..]),
        Token::Class { negated, ranges } => {
            s.first().is_some_and(|c| *c != '/' && ranges.iter().any(|(a, b)| (*a..=*b).contains(c)) != *negated)
                && matches_from(rest, &s[1..])
        }
        Token::Star => {
            for i in 0..=s.len() {
                if matches_from(rest, &s[i..]) {
                    return true;
                }
                if s.get(i) == Some(&'/') {
                    return false;
                }
            }
            false
        }
        Token::DoubleStar => {
            // `**/` may match nothing: skip the '/' that follows it.
            if rest.first() == Some(&Token::Char('/')) && matches_from(&rest[1..], s) {
                return true;
            }
            (0..=s.len()).any(|i| matches_from(rest, &s[i..]))
        }
    }
}

/// `4096`, `64k`, `1M`, `1.5G`: bytes, with binary multiples.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let (num, mult) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        None => (t, 1u64),
        Some((i, _)) => {
            let unit = t[i..].trim().to_ascii_lowercase();
            let mult = match unit.trim_end_matches("ib").trim_end_matches('b') {
                "" => 1,
                "k" => 1 << 10,
                "m" => 1 << 20,
                "g" => 1 << 30,
                "t" => 1 << 40,
                _ => return None,
            };
            (t[..i].trim(), mult)
        }
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult);
    }
    let f: f64 = num.parse().ok()?;
    (f.is_finite() && f >= 0.0).then_some((f * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(p: &str, s: &str) -> bool {
        Glob::new(p).unwrap().matches(s)
    }

    #[test]
    fn globs() {
        assert!(g("*.log", "a.log"));
        assert!(!g("*.log", "dir/a.log"), "a star stops at '/'");
        assert!(g("docs/**", "docs/a/b/c.txt"));
        assert!(g("docs/**", "docs/x"));
        assert!(!g("docs/**", "src/docs/x"));
        assert!(g("**/build/*.o", "build/a.o"));
        assert!(g("**/build/*.o", "x/y/build/a.o"));
        assert!(g("a/**/b", "a/b"));
        assert!(g("a/**/b", "a/x/y/b"));
        assert!(g("file?.[ch]", "file1.c"));
        assert!(!g("file?.[ch]", "file1.o"));
        assert!(g("[!a]*", "bcd"));
        assert!(!g("[!a]*", "abc"));
        assert!(g("[a-c]x", "bx"));
        assert!(g("\\*", "*"));
        assert!(!g("\\*", "a"));
        assert!(Glob::new("[ab").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64k"), Some(65536));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("1.5M"), Some(3 << 19));
        assert_eq!(parse_size("12 furlongs"), None);
    }
}
