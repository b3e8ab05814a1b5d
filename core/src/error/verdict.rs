//! The one verdict the ranks of a job reach on a step that every rank took
//! (a load, a discard): every rank contributes its own outcome, and every rank
//! derives the same answer from all of them, so no rank falls back to an older
//! checkpoint while another raises.

use crate::error::Error;

/// What every rank does after a step that failed on at least one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The failing rank whose error every rank reports (the lowest one of
    /// the failures that decide the verdict).
    pub rank: usize,
    /// True when every failure was damage ([`Error::is_damage`]): the ranks
    /// fall back to an older checkpoint together. False when any rank failed
    /// otherwise (bad input, a failing store, data this build cannot read):
    /// every rank raises.
    pub damage: bool,
}

/// The verdict from every rank's outcome of one step, in rank order (`None`:
/// that rank succeeded); `None` when every rank succeeded.
///
/// A failure that is not damage wins over damage: damage on one rank and,
/// say, [`Error::Unsupported`] on another is a raise on both.
pub fn verdict(outcomes: &[Option<Error>]) -> Option<Verdict> {
    let failed = || {
        outcomes
            .iter()
            .enumerate()
            .filter_map(|(r, e)| Some((r, e.as_ref()?)))
    };
    if let Some((rank, _)) = failed().find(|(_, e)| !e.is_damage()) {
        return Some(Verdict {
            rank,
            damage: false,
        });
    }
    failed()
        .next()
        .map(|(rank, _)| Verdict { rank, damage: true })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corrupt() -> Error {
        Error::corrupt("chunks/ab", None, "hash mismatch")
    }

    #[test]
    fn all_ok_is_no_verdict() {
        assert_eq!(verdict(&[None, None]), None);
        assert_eq!(verdict(&[]), None);
    }

    #[test]
    fn damage_everywhere_falls_back_reporting_the_first() {
        let v = verdict(&[
            None,
            Some(corrupt()),
            Some(Error::NotFound { what: "x".into() }),
        ]);
        assert_eq!(
            v,
            Some(Verdict {
                rank: 1,
                damage: true
            })
        );
    }

    #[test]
    fn unsupported_beside_damage_raises_on_every_rank() {
        for outcomes in [
            [Some(Error::Unsupported("newer".into())), Some(corrupt())],
            [Some(corrupt()), Some(Error::Unsupported("newer".into()))],
        ] {
            let v = verdict(&outcomes).unwrap();
            assert!(!v.damage, "{outcomes:?}");
            assert!(matches!(outcomes[v.rank], Some(Error::Unsupported(_))));
        }
    }

    #[test]
    fn a_failing_store_wins_over_damage() {
        let store = Error::Storage(object_store::Error::Generic {
            store: "s3",
            source: "503".into(),
        });
        let v = verdict(&[Some(corrupt()), None, Some(store)]).unwrap();
        assert_eq!(
            v,
            Verdict {
                rank: 2,
                damage: false
            }
        );
    }

    #[test]
    fn the_wire_form_keeps_the_verdict() {
        let back = |e: Error| Error::from_wire(&e.to_wire(), "rank 3: ").unwrap();
        let outcomes = [
            Some(back(corrupt())),
            Some(back(Error::Unsupported("u".into()))),
        ];
        assert_eq!(
            verdict(&outcomes),
            Some(Verdict {
                rank: 1,
                damage: false
            })
        );
        assert!(outcomes[1]
            .as_ref()
            .unwrap()
            .to_string()
            .contains("rank 3: u"));
        assert!(matches!(
            Error::from_wire(b"{not json", ""),
            Err(Error::InvalidInput(_))
        ));
    }
}
