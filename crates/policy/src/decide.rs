//! Deciding a file's chain: the node's path, the policy of its directory, the rules file.

use super::*;

impl PolicyLayer {
    /// The node's path relative to the mount root ("" for the root), as the layers above
    /// name it: the bottom's `lower-info` says, translated by any layer between (a crypt
    /// volume's names).
    pub(crate) fn rel_path(&self, node: NodeId) -> Result<String> {
        if node == NodeId::ROOT {
            return Ok(String::new());
        }
        let v = self.below().extended(&daemon(), node, "lower-info", &[])?;
        // Its path would be its last name with " (deleted)" added: no place to decide by.
        if v.get("removed").and_then(Value::as_bool) == Some(true) {
            return Err(Error::Os(libc::ENOENT));
        }
        v.get("path").and_then(Value::as_str).map(str::to_owned).ok_or(Error::Os(libc::EIO))
    }


    /// The policy directory `dir` hands down to new files: its own attribute, else its
    /// parent's. Cached until a directory policy changes or a directory moves.
    pub(crate) fn dir_decision(&self, dir: NodeId) -> Result<(Option<String>, Option<Decided>)> {
        let generation = self.generation.load(Ordering::Acquire);
        if let Some(d) = self.dirs.lock().get(&dir).filter(|d| d.generation == generation) {
            return Ok((d.path.clone(), d.decided.clone()));
        }
        // Paths serve to match rules and to name a directory's own policy; without either no
        // path is asked for (a deep tree's lower paths can pass PATH_MAX).
        let own = self.own_policy(dir)?;
        let path = if !self.rules.is_empty() || own.is_some() { Some(self.rel_path(dir)?) } else { None };
        let decided = match own {
            Some(chain) => Some(Decided { chain, source: Source::DirAttr(path.clone().unwrap_or_default().as_str().into()) }),
            None if dir == NodeId::ROOT => None,
            None => {
                let parent = self.below().lookup(&daemon(), dir, OsStr::new(".."))?;
                let inherited = self.dir_decision(parent.node);
                self.below().forget(&daemon(), parent.node, 1);
                inherited?.1
            }
        };
        let mut dirs = self.dirs.lock();
        if dirs.len() > 1 << 16 {
            dirs.clear();
        }
        dirs.insert(dir, DirState { generation, path: path.clone(), decided: decided.clone() });
        Ok((path, decided))
    }

    /// The policy for a file in `dir` named `name` of `size` bytes, ignoring any attribute of
    /// its own.
    pub(crate) fn decide_in(&self, dir: NodeId, name: &OsStr, size: u64) -> Result<Decided> {
        let (dir_path, from_dir) = self.dir_decision(dir)?;
        if let Some(d) = from_dir {
            return Ok(d);
        }
        if !self.rules.is_empty() {
            let name = name.to_string_lossy();
            let dir_path = dir_path.unwrap_or_default();
            let path = if dir_path.is_empty() { name.into_owned() } else { format!("{dir_path}/{name}") };
            if let Some(r) = self.rules.find(&path, size) {
                let slot = &self.rule_chains[r.number - 1];
                let chain = match slot.get() {
                    Some(c) => c.clone(),
                    None => {
                        let c = self.chain_for(&r.policy)?;
                        slot.get_or_init(|| c).clone()
                    }
                };
                return Ok(Decided { chain, source: Source::Rule(r.number, r.text.as_str().into()) });
            }
        }
        Ok(Decided { chain: self.default.clone(), source: Source::Default })
    }

    /// The parent directory and name of an existing file, found from its path. The returned
    /// guard holds the lookups made on the way until it is dropped.
    pub(crate) fn parent_and_name(&self, node: NodeId) -> Result<(Held<'_>, OsString, String)> {
        let path = self.rel_path(node)?;
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", &path));
        let mut held = Held { layer: self, nodes: Vec::new() };
        for comp in dir.split('/').filter(|c| !c.is_empty()) {
            let e = self.below().lookup(&daemon(), held.last(), OsStr::new(comp))?;
            held.nodes.push(e.node);
        }
        let name = OsString::from_vec(name.as_bytes().to_vec());
        Ok((held, name, path))
    }

    /// Which policy applies to an existing file, and where it came from.
    pub(crate) fn decide_existing(&self, node: NodeId) -> Result<(Decided, String, Held<'_>, OsString)> {
        let (held, name, path) = self.parent_and_name(node)?;
        let decided = match self.own_policy(node)? {
            Some(chain) => Decided { chain, source: Source::FileAttr },
            None => {
                let size = self.chain_of(node)?.top.getattr(&daemon(), node)?.size;
                self.decide_in(held.last(), &name, size)?
            }
        };
        Ok((decided, path, held, name))
    }
}
