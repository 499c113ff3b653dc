//! Names the commit a build was made from, for `plyfs --version`: `git describe` of the
//! working tree (with `-dirty` when it has changes), or `PLYFS_COMMIT` when set (a package
//! built outside git), or "unknown commit".

use std::process::Command;

fn main() {
    let commit = std::env::var("PLYFS_COMMIT").ok().filter(|c| !c.is_empty()).or_else(|| {
        let out = Command::new("git").args(["describe", "--always", "--dirty", "--abbrev=12", "--exclude=*"]).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned()).filter(|c| !c.is_empty())
    });
    println!("cargo:rustc-env=PLYFS_COMMIT={}", commit.unwrap_or_else(|| "unknown commit".into()));
    println!("cargo:rerun-if-env-changed=PLYFS_COMMIT");
    // A new commit or a change in the index changes what `git describe` says.
    if let Ok(out) = Command::new("git").args(["rev-parse", "--git-dir"]).output() {
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !dir.is_empty() {
            for f in ["HEAD", "index"] {
                println!("cargo:rerun-if-changed={dir}/{f}");
            }
        }
    }
}
