from services.frontend.server import main

main()
