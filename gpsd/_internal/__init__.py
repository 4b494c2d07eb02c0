"""Internals shared by gpsd's packages: validation, module-state snapshots, the fit lifecycle, progress.

Nothing here is public API; every package of gpsd may import it, and no package imports another
package's private modules.
"""
