//! Attacks on this leg: see [`super`] for the attacker and the rule.
