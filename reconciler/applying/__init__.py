"""Running a plan: a saved plan checked before the lock (`planfile`), the changes in dependency
order (`execute`), a member drained around its replace (`drain`), the progress shown."""
